"""The ``kvduplex`` command: `main` parses it and starts a process (`serve`, `router`,
`up`, `bench`); `settings` holds each command's settings model (flags, environment
and config file, `kvduplex.common.settings`)."""
