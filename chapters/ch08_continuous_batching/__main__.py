from chapters.ch08_continuous_batching.server import main

main()
