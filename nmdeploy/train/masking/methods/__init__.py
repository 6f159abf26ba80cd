"""Forward methods: one parametrisation per published way of training N:M masks, one module per family.

``base.py`` holds what every method shares (the ``NMParametrization`` base, the mask selector, the registry
``METHODS`` and ``register_training_method``) and the gradient rules of each method; ``straight_through.py`` the
methods ``ste``, ``srste``, ``step`` and ``fixed``; ``lbc.py`` learnable best combination; ``decay.py`` mask and
structure decay. Importing this package registers every method.
"""

from nmdeploy.train.masking.methods.base import (
    METHODS,
    MaskSelector,
    MethodOptions,
    NMParametrization,
    from_groups,
    register_training_method,
    to_groups,
)

# Methods register in the order --help and error messages list them: simplest first.
# isort: off
from nmdeploy.train.masking.methods.straight_through import (
    SRSTE,
    STE,
    STEP,
    FixedMask,
    FixedOptions,
    SRSTEOptions,
    STEPOptions,
)
from nmdeploy.train.masking.methods.lbc import LBC, LBCOptions
from nmdeploy.train.masking.methods.decay import DecayOptions, MaskDecay, StructureDecay

# isort: on

__all__ = [
    "LBC",
    "METHODS",
    "SRSTE",
    "STE",
    "STEP",
    "DecayOptions",
    "FixedMask",
    "FixedOptions",
    "LBCOptions",
    "MaskDecay",
    "MaskSelector",
    "MethodOptions",
    "NMParametrization",
    "SRSTEOptions",
    "STEPOptions",
    "StructureDecay",
    "from_groups",
    "register_training_method",
    "to_groups",
]
