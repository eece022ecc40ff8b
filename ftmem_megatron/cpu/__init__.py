"""CPU support: megatron-core (:mod:`.core`) and Megatron-LM's own training loop
(:mod:`.megatron_lm`) on a machine without CUDA, over gloo, for tests and trials.

Nothing here runs on a GPU cluster: the adapter's own code never imports this package,
and importing it changes nothing. A script switches it on explicitly, where CUDA is
absent, with ``core.enable()`` (the megatron-core driver) or ``megatron_lm.enable()``
(a Megatron-LM launch script). docs/megatron.md lists what each shim changes and why.
"""
