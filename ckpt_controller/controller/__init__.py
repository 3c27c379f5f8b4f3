"""The controller service: config, journal, operations, server, client."""
