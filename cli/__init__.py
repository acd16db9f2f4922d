"""The front door: the `eyas` command and everything that runs or plans several stages.

`eyas.cli.main` dispatches each command of the table in `eyas.cli.commands`; `quickstart`, `plan` and
`launch` are the tools that run, plan or launch the stages. Nothing below this floor (the stages in
`eyas.data`, `eyas.train`, `eyas.eval`, the shared library in `eyas/`) imports it.
"""
