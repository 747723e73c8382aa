from chapters.ch05_inference_engine.server import main

main()
