"""How close a candidate model's outputs are to a reference's: which outputs are judged, what each judged output
is measured by, one fidelity figure for a model, and user metrics (``module:function``).

Plain numpy on output arrays, below every layer that runs models, so that comparing models (``nmdeploy compare``),
recovery and the fidelity budget of a conversion all measure fidelity the same way.

Each judged output gets a measure that fits it (``auto``): a causal language model's logits its next-token
perplexity against the token ids fed (their cosine stays high while perplexity grows severalfold); the per-row
cosine of other wide outputs (embeddings, logits of many classes, a key/value cache), or their rows' scale agreement
where lower (a per-row cosine ignores length); across the batch (spread, 1 - MSE / 2
Var(reference)) for outputs of a few values per row (a probability, a box, a regression), whose per-row cosine is 1
whatever the candidate, for rows that all point one way, and for probability maps dominated by near-zero values (a
text detector's map of a photo without text, where a tiny shift of the background is a new direction). Task
measures judge whole outputs: CTC decodes, label sequences, a language model's next tokens (perplexity, top-1, KL).
A named measure judges the outputs it applies to and ``auto`` every other judged output. A figure the data cannot
move (a constant output would score as high) is ill-conditioned: reported, never PASSED. A model's figure is its
lowest judged output's.

modules: ``selection`` (which outputs, their rows), ``comparison`` (one output's errors and figures),
``registry`` (the measures' table and user metrics), ``measures`` (output measures), ``tasks`` (task measures),
``detection`` (boxes matched by IoU),
``meter`` (measuring batches, one figure per model).
"""

from nmdeploy.fidelity import detection, measures, tasks  # noqa: F401  (registers the built-in measures)
from nmdeploy.fidelity.comparison import CHANCE_LIMIT, FEW_VALUES, Figure, OutputComparison
from nmdeploy.fidelity.measures import DEFAULT_IOU_THRESHOLD
from nmdeploy.fidelity.meter import (
    IllConditionedError,
    Meter,
    fidelity,
    measure,
    metric_label,
    model_fidelity,
    model_figure,
    output_figure,
)
from nmdeploy.fidelity.registry import (
    METRICS,
    FidelityMetric,
    Metric,
    TaskMetric,
    check_min_fidelity,
    is_builtin_metric,
    load_metric,
    metric,
    metric_value,
    metrics_help,
    parse_spec,
    resolve_metric,
)
from nmdeploy.fidelity.selection import (
    NEAR_ZERO,
    NEAR_ZERO_SHARE,
    OutputSelection,
    background_share,
    follows_tokens,
    is_float_array,
    select_outputs,
)

__all__ = [
    "CHANCE_LIMIT",
    "DEFAULT_IOU_THRESHOLD",
    "FEW_VALUES",
    "METRICS",
    "NEAR_ZERO",
    "NEAR_ZERO_SHARE",
    "FidelityMetric",
    "Figure",
    "IllConditionedError",
    "Meter",
    "Metric",
    "OutputComparison",
    "OutputSelection",
    "TaskMetric",
    "background_share",
    "check_min_fidelity",
    "fidelity",
    "follows_tokens",
    "is_builtin_metric",
    "is_float_array",
    "load_metric",
    "measure",
    "metric",
    "metric_label",
    "metric_value",
    "metrics_help",
    "model_figure",
    "model_fidelity",
    "output_figure",
    "parse_spec",
    "resolve_metric",
    "select_outputs",
]
