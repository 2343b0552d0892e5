"""ember.router: the router's decisions (endpoint load and cost, session affinity, prefix index,
circuit breaking) as pure Python; the HTTP proxy that calls them lives beside them."""
