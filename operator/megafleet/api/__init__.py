"""The megafleet API: typed models of the custom resources, and CRD generation from them."""
