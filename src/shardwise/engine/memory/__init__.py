"""Where values live and in which dtype: mixed precision, offload to memory-mapped files, and
one host copy of frozen weights.

Read in this order: precision.py → offload.py → host_param.py → host_file.py → host_copy.py.
"""
