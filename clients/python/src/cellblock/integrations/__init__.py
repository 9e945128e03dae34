"""Adapters that let agent frameworks run their code in cellblock sessions, through the framework's own executor
interface. Each imports its framework, which the SDK does not depend on: install the framework to use its adapter
(``cellblock.integrations.autogen`` needs ``autogen-core``, ``cellblock.integrations.smolagents`` needs
``smolagents``)."""
