"""What a compiled TPU step costs: FLOPs, HBM bytes and collectives from the optimized HLO (`hlo_cost`,
`collectives`), ICI time on the torus (`ici`), step categories (`categories`), model FLOPs (`flops`), chip facts
(`chips`) and decode memory traffic (`decode_traffic`)."""
