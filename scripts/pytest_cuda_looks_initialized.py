"""pytest plugin: run CPU tests as if CUDA were initialized (and never capturing), to find code that a trace reaches
only on a GPU. torch.cuda.is_current_stream_capturing stays torch's own function, which Dynamo cannot trace (it
returns a bool), so a compiled test fails here exactly where it would fail on a GPU (session 41's run 4).

    PYTHONPATH=scripts python -m pytest -p pytest_cuda_looks_initialized tests/test_compile.py

Expected (session 41): every test passes except the two Inductor ones, whose compiler then asks the CPU build for
a CUDA device (`torch._C._cuda_getDevice`): an artifact of the simulation, not of fp_recipes."""
import torch
import torch.cuda.graphs

torch.cuda.is_initialized = lambda: True
torch.cuda.graphs._cuda_isCurrentStreamCapturing = lambda: False  # the eager code around the graphs
