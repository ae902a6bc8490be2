"""Reuse policies, one plug-in a file: each states its passes over the layers and chooses rows
per layer through a narrow, read-only interface (`engine_adapter.selection`). The names a
deployment configures them by are `engine_adapter.policy`."""
