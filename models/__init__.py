"""The reference models' data (sentences, baselines, run configurations), installed as ``nmdeploy.models``."""
