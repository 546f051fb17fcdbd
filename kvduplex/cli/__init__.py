"""The ``kvduplex`` command: `main` parses it and starts a process (`serve`, `router`,
`up`, `bench`); `flags` and `settings` turn its flags, environment and config file
into settings."""
