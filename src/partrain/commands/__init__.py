"""The subcommands other than ``train``: each module a ``add_*_parser(sub)`` and its ``cmd_*(args)``."""
