"""Argument groups: each owns one flag family, declares it once (``add_to(parser)``) and reads it back into what
the library takes (``parse(args)``), so every verb that takes a family means the same by it.

Nothing heavy is imported at module level: a verb's groups load with it, and ``--help`` stays instant.
"""

from nmdeploy.cli.args.base import ArgGroup, add_groups
from nmdeploy.cli.args.baselines import BaselinesArgs, PipelineArgs
from nmdeploy.cli.args.conversion import ConversionArgs
from nmdeploy.cli.args.data import BatchAxisArgs, CalibrationArgs, DataArgs
from nmdeploy.cli.args.fidelity import FidelityArgs, OutputsArgs, RecoveryArgs
from nmdeploy.cli.args.files import OutputArgs, ReportArgs
from nmdeploy.cli.args.precision import PrecisionArgs
from nmdeploy.cli.args.runtime import BatchArgs, DeviceArgs, EngineArgs, ShapesArgs, TimingArgs
from nmdeploy.cli.args.sources import HookArgs, ImageArgs, ShardArgs, TextArgs
from nmdeploy.cli.args.training import ExportArgs, ResumeArgs
from nmdeploy.cli.args.weights import PatternArgs, RequireArgs, SelectionArgs

__all__ = [
    "ArgGroup",
    "BaselinesArgs",
    "BatchArgs",
    "BatchAxisArgs",
    "CalibrationArgs",
    "ConversionArgs",
    "DataArgs",
    "DeviceArgs",
    "EngineArgs",
    "ExportArgs",
    "FidelityArgs",
    "HookArgs",
    "ImageArgs",
    "OutputArgs",
    "OutputsArgs",
    "PatternArgs",
    "PipelineArgs",
    "PrecisionArgs",
    "RecoveryArgs",
    "ReportArgs",
    "RequireArgs",
    "ResumeArgs",
    "SelectionArgs",
    "ShapesArgs",
    "ShardArgs",
    "TextArgs",
    "TimingArgs",
    "add_groups",
]
