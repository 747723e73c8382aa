from chapters.ch03_dynamic_batching.server import main

main()
