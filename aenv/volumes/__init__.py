"""Volumes: directories that outlive sandboxes, mounted into them by name (E2B's /volumes API and
its content API), shared live between the sandboxes that mount them."""
