"""Models: the spec a user registers, the zoo built from code, weights I/O and the
binding of a module's tensors to arena memory."""
