"""The plugin's fairseq criterions (registered by ``fairseq_tnn.register()``)."""
