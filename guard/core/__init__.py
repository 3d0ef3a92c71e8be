"""Pure rules: no flask, kubernetes, sockets, clock or files. Where a ghost is decided: `verdict.decide()`."""
