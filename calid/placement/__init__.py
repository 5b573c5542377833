"""Several models on one device pool: profiles, arrivals, a discrete-event simulator and AlpaServe's
placement search (pure: no ray, no model)."""
