"""meshplan: a declarative model-partitioning compiler for PyTorch.

One `.plan` file names a device mesh and placement rules over a model's module paths;
meshplan checks it against the model, rewrites the model's graph and lowers it to a
per-rank torch.distributed program with explicit collectives.
"""

import importlib.metadata

__version__ = importlib.metadata.version("meshplan")  # pyproject.toml's
