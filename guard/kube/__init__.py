"""The only package that imports `kubernetes`: the client, the quorum GET's transport, replica reads, writes."""
