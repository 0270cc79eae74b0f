"""The `specdeploy` command. Heavy imports happen inside subcommands, never here."""
