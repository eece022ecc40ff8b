"""The test harness: starting ranks (``ranks``), the jobs of each trainer (``toy``,
``ds_jobs``, ``megatron_jobs``), shared helpers (``common``), and the scripts the tests
run as ranks (``lifecycle_job``, ``stock_deepspeed_train``)."""
