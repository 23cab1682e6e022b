"""Text that `kev bench load` builds its long prompts from: passages written for this benchmark
(no dataset needed), the tasks asked about them, and the shared system prompt."""

PASSAGES = [
    "The harbour town grew around a single stone pier built in the fourteenth century. Fishing boats "
    "landed herring there every autumn, and the salt merchants who bought the catch built the tall narrow "
    "houses that still line the waterfront. When the river silted up in the seventeenth century, larger "
    "ships could no longer reach the pier, and trade moved to a deeper port twenty miles south. The town "
    "shrank to a village of a few hundred people. Its revival came with the railway in 1862, which brought "
    "visitors from the inland cities for sea air and bathing. Hotels replaced the salt warehouses, and the "
    "old pier was lengthened with iron so that pleasure steamers could call in the summer months.",
    "A relational database stores data in tables of rows and columns. Each table has a primary key, a "
    "column or set of columns whose values identify one row. A foreign key in one table refers to the "
    "primary key of another, which is how a database records that an order belongs to a customer. Queries "
    "combine tables with joins. An index is a separate structure, usually a B-tree, that keeps the values "
    "of some columns sorted together with pointers to their rows, so that a lookup reads a few pages "
    "instead of the whole table. Indexes speed up reads but slow down writes, since every insert or update "
    "must change each index as well. Transactions group several changes so that either all of them happen "
    "or none does, even if the machine fails half way through.",
    "Honey bees live in colonies of tens of thousands of workers, a few hundred drones and one queen. The "
    "workers are all female; in their first weeks they clean cells, feed larvae and build comb from wax "
    "made by glands on their abdomen. Older workers become foragers and fly up to several kilometres to "
    "collect nectar and pollen. A forager that finds a rich source returns to the hive and performs a "
    "waggle dance: the angle of the dance against the vertical gives the direction of the source relative "
    "to the sun, and the length of the waggle run tells how far away it is. Nectar is passed from bee to "
    "bee, evaporated by fanning wings, and sealed in wax cells as honey, the colony's food for winter.",
    "The bridge took eleven years to build. Its two towers stand on caissons sunk through river mud to "
    "bedrock, and workers in the pressurised chambers below the water suffered from a then mysterious "
    "illness later understood as decompression sickness. The chief engineer directed the final years of "
    "construction from a window of his apartment, watching the work through a telescope, after the same "
    "illness left him unable to walk. The main span hangs from four cables, each spun in place from more "
    "than five thousand parallel steel wires. When it opened, a crowd of more than a hundred thousand "
    "people crossed on foot in the first day, and the toll for a pedestrian was one cent.",
    "A compiler translates a program written in one language into another, usually into machine code. "
    "The front end reads the source text, splits it into tokens, and parses the tokens into a syntax tree "
    "according to the grammar of the language. Semantic analysis then checks types and resolves names. "
    "The middle of the compiler works on an intermediate representation, where optimisations such as "
    "constant folding, inlining, dead code elimination and loop transformations are applied. The back end "
    "chooses machine instructions, allocates registers, and schedules instructions to keep the processor's "
    "pipelines busy. Just-in-time compilers do the same work while the program runs, and can use what they "
    "observe about the running program to specialise the code they produce.",
    "The expedition left the coast in early March with forty porters, twelve mules and food for ninety "
    "days. The first weeks went well: the track followed the river through forest, and the party covered "
    "twenty kilometres a day. In the highlands the rains began early. Two mules were lost at a river "
    "crossing, together with most of the rice, and the leader decided to send half of the porters back. "
    "The remaining party reached the plateau in May, mapped the sources of three rivers, and collected "
    "more than two thousand plant specimens, many of them unknown to science. The return journey took "
    "only five weeks because the rivers, now in flood, could be descended by raft.",
    "Sourdough bread is leavened by a culture of wild yeasts and lactic acid bacteria kept alive in a "
    "mixture of flour and water. The baker feeds the starter with fresh flour and water every day; the "
    "yeasts produce carbon dioxide that raises the dough, and the bacteria produce lactic and acetic acids "
    "that give the bread its sour taste and help it keep longer. A typical loaf is made by mixing flour, "
    "water, salt and a portion of active starter, folding the dough several times during a slow first "
    "rise, shaping it, and letting it rise again, often overnight in a cool place. It is baked in a very "
    "hot oven, ideally with steam for the first minutes so that the crust stays soft while the loaf expands.",
    "Plate tectonics explains the large features of the Earth's surface. The outer shell is broken into "
    "plates that move a few centimetres a year over the hotter, softer mantle beneath. Where plates move "
    "apart, as along the middle of the Atlantic, magma rises and forms new ocean floor. Where they meet, "
    "one plate may sink beneath the other into the mantle, producing deep trenches, volcanoes and strong "
    "earthquakes; where two continents collide, neither sinks easily and the crust folds into high mountain "
    "ranges. Along transform faults the plates slide past each other sideways. The theory drew on evidence "
    "from matching coastlines and fossils, magnetic stripes on the sea floor, and the pattern of earthquakes.",
]

LONG_TASKS = [
    "Summarise the notes above in three sentences.",
    "What is the main topic of the notes above? Answer in one sentence.",
    "List three facts from the notes above.",
    "Write a short title for the notes above.",
    "Which detail in the notes above is the most surprising, and why?",
    "Explain the notes above to a twelve-year-old.",
]

# --streams: questions whose answers run long, decoding while the long prompts arrive
STREAM_TASKS = [
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a steam engine works, step by step, with examples.",
    "Write a long letter from a traveller describing a journey across the mountains.",
    "Describe, in as much detail as you can, a day in the life of a medieval baker.",
    "Write a detailed guide to planting and caring for a vegetable garden.",
    "Tell a long story about two friends who build a boat and sail around an island.",
    "Explain the history of the printing press and how it changed the world, in detail.",
    "Write a long essay about why people have always looked at the stars.",
]

SYSTEM_PROMPT_TEXT = (
    "You are the assistant of a public library's help desk. Answer the visitor's question politely, "
    "accurately and briefly. If you do not know the answer, say so and suggest where the visitor could "
    "look it up: the reference desk on the ground floor, the catalogue terminals next to the stairs, or "
    "the librarian on duty. Never invent book titles, authors or opening hours. The library is open from "
    "nine in the morning to eight in the evening on weekdays and from ten to four on Saturdays; it is "
    "closed on Sundays and public holidays. Visitors may borrow up to twelve items for three weeks and "
    "renew them twice online unless another reader has reserved them. "
)
