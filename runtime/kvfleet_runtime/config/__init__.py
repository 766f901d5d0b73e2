"""Config files: the fleet config's schema (`fleet`: what the operator publishes and
the router and every replica read) and the one config-file watcher (`watch`), shared by the
replica, the router, the fleet tier and the vLLM connector. Torch-free and network-free: the
operator imports the schema."""
