"""Methods and masking: which layers become N:M and how their masks train, apart from running a training.

``sparsify.py`` chooses layers and attaches a method's parametrisation (``methods.py``, schedules in
``schedules.py``) and the masked backward passes (``backward.py``, ``attention.py`` for ``nn.MultiheadAttention``);
``oneshot.py`` gives a pretrained model its first masks (SparseGPT from calibration batches); ``step.py`` is the
optimiser of method ``step``; ``settings.py`` the typed ``[sparsity]`` table; ``sharding.py`` gathers FSDP2 shards.
"""
