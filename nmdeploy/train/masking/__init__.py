"""Methods and masking: which layers become N:M and how their masks train, apart from running a training.

``selection.py`` chooses the layers (and says why the others stay dense); ``sparsify.py`` attaches a method's
parametrisation (``methods/``, one module per family of methods; schedules in ``schedules.py``) and the masked
backward passes (``backward.py``, ``attention.py`` for ``nn.MultiheadAttention``); ``finalize.py`` bakes the masks
into plain weights at the end;
``oneshot.py`` gives a pretrained model its first masks (SparseGPT from calibration batches); ``step.py`` is the
optimiser of method ``step``; ``settings.py`` the typed ``[sparsity]`` table; ``sharding.py`` gathers FSDP2 shards.
"""
