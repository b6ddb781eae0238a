"""Generative language models (issue 18): Hugging Face model directories loaded through
the runtime's own weight path. Importing this package does not import ``transformers``;
its functions do, when called."""
