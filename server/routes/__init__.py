"""The HTTP routes, one module per API: each turns its body into a generation plan, hands it to the
one flow (`server/flow/`) and formats what comes back in its API's shape; `admin.py` serves
everything around generation (health, models, tokenize, metrics, stats, the page)."""
