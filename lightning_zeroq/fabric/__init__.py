"""The Fabric integration: ``ZeroQFabricStrategy`` (``strategy``) and its checkpoint glue (``checkpoint``)."""
