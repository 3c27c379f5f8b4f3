"""The controller service: config, journal, operations (service and its parts by job), server,
client. Neighbours: ``agent.client`` (how it reaches engines), ``cli.controller_cmds``."""
