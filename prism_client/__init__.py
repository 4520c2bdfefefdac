"""Prism's client library: it talks to a running server over Triton's HTTP or gRPC protocol and
nothing else. It imports neither the engine (prism_backend, torch) nor the launcher
(prism_launcher); tests/test_layout.py keeps it so.

    client.py             PrismClient, AsyncPrismClient
    determinism.py        the bits' digest and the request set of the determinism checks (numpy only;
                          the engine's self-check uses the same digest)
    determinism_check.py  `prism determinism-check`
    cli.py                the client's commands: decide, determinism-check, health
                          (`python -m prism_client ...`; `prism` has them too)
"""
