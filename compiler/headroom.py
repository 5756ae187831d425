"""Of each rank's memory, the share a suggested plan leaves free for what `estimate` does not
count: the CUDA context, NCCL's and the kernels' workspaces, the caching allocator's
fragmentation. Apart from `suggest.py` and free of torch: the command line's parser shows it as
`--headroom`'s default without loading torch (`meshplan fmt` and `--help` stay quick)."""

HEADROOM = 0.08
