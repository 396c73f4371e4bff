"""Image primitives below storage and loaders: decoding encoded images to RGB uint8 (`decode`), crop-box
geometry (`geometry`), the stored frames' shape and pixels (`frames`) and the resize/crop/flip kernels
(`resize`). Both the conversions (`loadopt.storage`) and the backends (`loadopt.loaders`) build on these;
this package imports neither. The per-sample crop plan (which box and flip a sample gets for a seed and
epoch) is the loaders' (`loadopt.loaders.transforms`)."""
