"""Benchmarks shipped beside the ftmem library (run by ``ftmem bench``); the library never imports them."""
