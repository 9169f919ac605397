"""Generated code: do not edit (see codegen/)."""
