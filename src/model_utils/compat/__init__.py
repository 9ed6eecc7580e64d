"""The kit's uses of other libraries' private parts, one module per library, each where nothing public does the
job (docs/architecture.md lists them; tests/unit/compat/ fails with a clear message when an upgrade removes one).
Nothing outside this package reaches into another library's underscore names or patches its internals."""
