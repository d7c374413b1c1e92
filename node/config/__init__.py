"""The node's configuration: read once from the environment and flags at the entrypoint, then passed down.

Nothing below the entrypoint reads the environment; it gets a frozen NodeConfig (settings.py), built by
parse_config (parse.py) from the readers of each kind of setting: the secrets (credentials.py), where the node
listens and how it is reached (network.py), the model it serves (model.py), all on the flag-or-variable lookup
of sources.py.
"""
