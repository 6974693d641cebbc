"""The Envoy side of Portico: the Lua error shaper, the descriptor-set build and the Envoy launcher."""
