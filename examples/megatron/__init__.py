"""Megatron example: a GPT pretraining driver on megatron-core; not imported by the library."""
