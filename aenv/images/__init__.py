"""OCI images: references, a registry (distribution v2) client, and layers unpacked for overlayfs."""
