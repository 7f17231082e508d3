"""What travels between ranks and lands on disk, below every package that uses it: a safetensors
header's bounded parsing (st_header.py) and the small messages ranks exchange (messages.py)."""
