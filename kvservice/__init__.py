"""kvcraft service: store, planner, tiers, server, CLI. Imports no torch."""
