"""Quantized weights: the internal layouts (linear.py), their Triton kernels (kernels.py), the checkpoint formats
that map onto them (formats.py; gguf_file.py, its blocks unpacked by gguf_blocks.py), round-to-nearest quantization
(rtn.py) and the writer of compressed-tensors checkpoints (writer.py). docs/MODEL.md, "Quantized weights"."""
