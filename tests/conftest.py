import sys
from pathlib import Path

# Test modules share small model builders (for example test_onnx_prune.build_mlp).
sys.path.insert(0, str(Path(__file__).resolve().parent))
