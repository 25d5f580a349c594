"""Image classification: ImageFolder data, torchvision and CIFAR models, top-k metrics."""
