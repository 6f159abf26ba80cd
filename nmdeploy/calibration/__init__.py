"""Calibration: the data a model is calibrated on, and the statistics gathered by running the model over it.

Calibration data (:mod:`.data`), the streamed statistics engine (:mod:`.statistics`: X^T X of each weight's GEMM
input, segment by segment) and activation statistics for quantization (:mod:`.activation_statistics`). It sits
above the runtimes, which run the model, and below the passes and the conversion, which consume what it measures.
"""
