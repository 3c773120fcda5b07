from partrain.cli import main

raise SystemExit(main())
