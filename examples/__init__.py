"""Runnable examples shipped beside the ftmem library (trainers, drivers, demos); the library never imports them."""
