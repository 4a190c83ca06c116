"""Reading and writing checkpoints: safetensors files, output directories, sources in other precisions."""
