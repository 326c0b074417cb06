"""fxpipe: a pipeline-parallelism compiler for PyTorch."""

__version__ = "0.1.0"
