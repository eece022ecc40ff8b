"""ftmem for Megatron: a GPT pretraining driver on megatron-core
(``python -m ftmem_megatron.pretrain_gpt``, Megatron-LM's flag names), its
``--ckpt-format torch`` persistent checkpoints, and the compatibility layer that runs
megatron-core on CPU (gloo) where no GPU is present."""
